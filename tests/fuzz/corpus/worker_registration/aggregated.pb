*€Ð•ÿ¼1
llama-3-8b 08€ @P€@X€`h¸rkvr.default.worker.42.generatezkvr.default.worker.42.dump