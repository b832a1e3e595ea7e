"""Moved: a codec is its reducer in :mod:`gradsync.comm`; its DDP hook is :func:`gradsync.comm.ddp.reducer_hook`."""

raise ImportError("gradsync.strategies.codecs moved to gradsync.comm: build the codec with "
                  "gradsync.comm.build_reducer('int8', ledger=..., chunk_size=...) and register "
                  "gradsync.comm.ddp.ReducerHookState(reducer).bind(model.named_parameters()) with reducer_hook; "
                  "the codec functions are gradsync.comm.codecs.int8, sign, topk, powersgd")
