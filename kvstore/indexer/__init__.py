"""The indexer HTTP API gateways share (Mooncake RFC #1403), over the prefix index: ``api`` reads bodies and
computes answers, ``server`` is the aiohttp server of ``strata index serve``. Its own package because it
uses both the index and the router's HTTP error tree, and neither imports the other back."""
