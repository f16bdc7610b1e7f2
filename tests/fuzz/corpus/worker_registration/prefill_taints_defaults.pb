*€Ð•ÿ¼1
llama-3-8b *canary08€ Jgpu=h100Jzone=aP€@X€rkvr.default.worker.42.generatezkvr.default.worker.42.dump