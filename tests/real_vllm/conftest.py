"""Real-vLLM tests: collected only where vLLM is installed (scripts/test-vllm.sh's .venv-vllm)."""

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("vllm") else ["test_*.py"]
