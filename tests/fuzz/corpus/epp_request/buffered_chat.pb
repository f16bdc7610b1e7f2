¡š
—

:methodPOST

:path/v1/chat/completions
 
content-typeapplication/json

X-Session-Idchat-7

x-kvr-tenantteam-a

x-kvr-priority2Z|"z
v{"model":"qwen3","messages":[{"role":"user","content":"Hello"}],"stream":true,"stream_options":{"include_usage":true}}


:status200