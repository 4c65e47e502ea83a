"""One benchmark per module: `rlboost bench NAME [args]` calls `NAME.main(argv, settings)`.
Each prints human-readable figures and ends with one JSON line."""
