"""DeepSpeed ZeRO checkpoints read without DeepSpeed: its plain engine layout, Lightning's ``DeepSpeedStrategy``
directories and the universal layout ``ds_to_universal`` writes. Imports ``checkpoint/base`` and
``checkpoint/sharded``; nothing here imports ``deepspeed`` (its pickled objects are mapped onto stand-ins:
``checkpoint/deepspeed/unpickle.py``)."""
