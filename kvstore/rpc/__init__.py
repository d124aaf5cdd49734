"""What every RPC surface shares: the mapping between Strata errors and gRPC statuses."""
