.,
*

:methodGET

:path/v1/completions