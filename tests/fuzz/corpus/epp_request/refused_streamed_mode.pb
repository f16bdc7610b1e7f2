82
0

:methodPOST

:path/v1/chat/completionsZ