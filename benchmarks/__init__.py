"""The benchmarks, by topic (benchmarks/README.md): scripts run from the checkout's root as
``python benchmarks/<topic>/<script>.py``; their shared helpers are in benchmarks.common. A package
so that scripts and tests import each other as ``benchmarks.<topic>.<script>``; nothing under
engine/, kernels/, serving/ or openai_frontend/ imports it."""
