"""What every kernel runs on: a batch's document boundaries and what its layers derive from them
(``documents``), the shipped launch configurations (``tuned_configs``) and the compile plans (``precompile``)."""
