"""Codec names live in one place: gradsync.comm."""


def test_the_codec_type_names_every_reducer_and_each_strategy_takes_it():
    import inspect
    import typing

    from gradsync.comm import REDUCERS, Codec
    from gradsync.strategies import CompressedStrategy, DiLoCoStrategy, LocalSGDStrategy

    assert typing.get_args(Codec) == tuple(REDUCERS)
    # strategies' codec options use it (the CLI's --strategy.codec choices come from the annotation)
    for cls in (CompressedStrategy, LocalSGDStrategy, DiLoCoStrategy):
        for klass in cls.__mro__:
            if "codec" in inspect.signature(klass.__init__).parameters:
                hints = typing.get_type_hints(klass.__init__)
                assert hints["codec"] is Codec, cls
                break
