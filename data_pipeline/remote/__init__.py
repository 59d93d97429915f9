"""A prepared data folder read from a URL: http(s)://, s3:// (fsspec/s3fs) or a pipe: command (docs/design.md §2).

location.py parses data.path (and data.shards' brace lists) into a Location and redacts credentials for messages;
fetch.py reads one file with retries that resume from the byte where a transfer broke, a stall timeout, bounded
backoff and size/sha256 checks; cache.py keeps verified shards on local disk under their sha256 with a size limit;
prefetch.py fetches a reader's next shards in the background; shard_files.py puts these together for ShardSource;
tokenizer_files.py brings the tokenizer folder down beside them. The lane streams' cursor depends on the manifest
alone, so a stream read from a URL is token for token the stream of a local copy.
"""
