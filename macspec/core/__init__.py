"""The backend-neutral speculative core."""
