"""The foundation every layer stands on: the project's errors, the MACSPEC_* switches (read
once), where files live, logging, and the platform's facts (device, BLAS, memory bandwidth)."""
