
req-1
llama-3-8bdefault @€