"""The step's searches: partition sizes chosen by a fit check (`partitions`) and the max-length search
over probes of one step at a length (`probe`). The top room: it reads simulations and runs, never the
estimates."""
