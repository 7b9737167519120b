"""The project's command line (``tritonllm``, tritonllm/cli.py), the top of the house, above the
OpenAI frontend: ``serve`` (serve.py), ``launch`` (launcher.py), ``fill-template``
(fill_template.py) and ``templates``. It runs from an installed wheel as from a source checkout;
paths.py says where the model-repository templates are in each."""
