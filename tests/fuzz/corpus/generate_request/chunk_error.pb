
req-1 *(08BerrorJengine crashed