"""The project's command line (``tritonllm``, installed by pip): the top of the house, above the
OpenAI frontend; it starts what scripts/ and all_models/ hold, so it runs from a source checkout
(``pip install -e .``, as scripts/setup_env.sh installs it)."""
