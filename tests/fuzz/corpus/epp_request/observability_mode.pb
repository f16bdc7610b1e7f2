)!


:path/v1/chat/completionsPZ