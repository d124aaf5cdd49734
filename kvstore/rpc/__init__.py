"""What every RPC surface shares: the mapping between Strata errors and gRPC statuses (``status``), and
the refusal of request bytes that are not the method's message (``decoding``)."""
