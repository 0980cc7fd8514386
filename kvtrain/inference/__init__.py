"""Using a trained kvtrain checkpoint: loading its model at any layout
(``loading``); generation, export and evaluation build on it."""
