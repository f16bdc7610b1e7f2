
n1-00000001"client disconnected