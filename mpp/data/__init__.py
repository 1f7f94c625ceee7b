"""Reading and writing image corpora: the resumable shard stream, damaged-archive detection, the shard format, prepare's sources and writer."""
