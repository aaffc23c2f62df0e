"""Tools that run from a checkout of portable_spec and are not installed with it: the benchmark
(``bench/``), the GPU check (``devicecheck/``), the soak run (``soak``) and a quick look at the
builder (``masks``). ``python -m tools --help`` lists the commands."""
