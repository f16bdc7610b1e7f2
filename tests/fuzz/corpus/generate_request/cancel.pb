
req-1