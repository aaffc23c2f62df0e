"""The benchmark (``python -m tools.bench``, ``scripts/bench.sh``): the command line in
:mod:`tools.bench.cli`, the run in :mod:`tools.bench.runner`, one module per section
(``build``, ``staging``, ``apply``, ``overlap``, ``engines``, ``chains``, ``layouts``,
``percall``), shared timing in :mod:`tools.bench.timing` and workloads in
:mod:`tools.bench.workloads`; :mod:`tools.bench.tables` and :mod:`tools.bench.report` print."""
