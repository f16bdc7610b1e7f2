82
0

:methodPOST

:path/v1/chat/completionsZ¡"ž
™%nest 40000	{"a":	1	}
{"model":"qwen3","messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function","function":{"name":"f","parameters":%%}}]}