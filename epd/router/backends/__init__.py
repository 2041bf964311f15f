"""What runs a preprocessed request for the router's pipeline: the disaggregated tiers over gRPC
(``disaggregated``) or the whole model in this process (``in_process``). Both implement
``base.Backend``; the pipeline never knows which one it has."""
