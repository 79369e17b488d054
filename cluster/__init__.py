"""The composition root: the `tandem` command line and (later) cluster launching."""
