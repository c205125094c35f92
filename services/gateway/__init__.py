"""The gateway role (API server): validates and tokenizes requests, detokenizes and stops outputs."""
