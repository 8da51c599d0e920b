"""Commands a participant or an operator runs beside the daemon, against a live run.

``doctor`` checks that this machine can take part in a run (the coordinator reachable and the
same run, the token accepted, the clock, a presigned upload and download through the store and
its bandwidth, disk, memory, threads, a GPU) and says how to fix what is wrong; ``export`` fetches
the run's newest checkpoint as a verified safetensors file with its run config.
"""
