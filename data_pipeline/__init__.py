"""memlm.data_pipeline: corpora -> tokenizers -> webdataset shards -> lane streams (docs/design.md §2).

corpora.py and tasks.py read documents (the unit memory never crosses) or generate the RMT tasks; tokenizers.py
trains and applies them; prepare.py and shards.py write a DATA_DIR (shards + manifest.json, format.py is the on-disk
contract); stream.py, lanes.py, doc_order.py and cursor.py turn it into batches of B lanes x N-token segments with
per-lane document resets and a resumable cursor. Knows nothing of models, trainer or cluster.
"""
