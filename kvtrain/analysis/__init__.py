"""Reading finished runs and comparing them (``kvtrain compare``); imports no torch."""
