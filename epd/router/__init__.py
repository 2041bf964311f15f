"""The router: the one request pipeline (``pipeline``), its backends (``backends/``), the front ends
that only translate (``openai/``, ``grpc_api``) and the rule both apply to a request
(``request_rule``), and admission, routing, workers, media, metrics."""
