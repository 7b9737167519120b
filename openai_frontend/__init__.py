"""An OpenAI-compatible HTTP API (``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``)
in front of a running tritonserver serving this project's model repository.

The top of the stack: it imports ``serving`` (tokenizer loading) and ``tritonclient``; nothing
imports it. Requests go over gRPC streaming to ``tensorrt_llm`` (token ids; or, if asked, to
``tensorrt_llm_bls`` with text), so batching, metrics and leader mode stay in Triton. Files:
protocol.py (request validation), chat_template.py (prompts and token counts), triton_client.py
(the gRPC stream), detokenizer.py (ids -> streamed text),
stop_strings.py, generation.py (choices), responses.py / sse.py (what goes out), metrics.py,
app.py (aiohttp routes), __main__.py (CLI). Structured output and tools: guides.py
(response_format and vLLM's guided_* -> the engine's guide), tools.py (tools, tool_choice, tool
history), tool_calls.py and tool_parsers/ (the model's text -> tool_calls, streamed).
"""
