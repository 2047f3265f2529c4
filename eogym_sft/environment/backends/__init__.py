"""Tool backends: ``crop`` (computed on the data root), ``replay`` (the row's recorded results), ``http`` (a tool
server)."""
