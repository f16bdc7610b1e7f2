:4
0

:methodPOST

:path/v1/chat/completionsZ