"""One module per `streambp-bench` command; each computes through `streambp_core` and only prints here."""
