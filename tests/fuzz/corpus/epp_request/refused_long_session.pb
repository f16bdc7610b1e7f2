‰
†

:methodPOST

:path/v1/chat/completions
½
x-session-id¬ssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssssss

x-kvr-priority-1Z>"<
8{"model":"m","messages":[{"role":"user","content":"x"}]}