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


def test_no_codec_name_is_compared_outside_comm():
    """What a strategy needs of a codec is a trait read through CodecSpec (momentum-correctable, masks what
    it sent, survives a membership change, all-gathered, a round's error decay, Adam options): no code above
    comm tests a codec's name, so a new codec is added in comm alone."""
    import ast
    from pathlib import Path

    from gradsync.comm import REDUCERS

    names = set(REDUCERS)
    root = Path(__import__("gradsync").__file__).parent
    found = []
    for path in root.rglob("*.py"):
        if path.relative_to(root).parts[0] == "comm":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                for side in [node.left, *node.comparators]:
                    values = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                    if any(isinstance(v, ast.Constant) and v.value in names for v in values):
                        found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not found, found


def test_the_traits_say_what_the_strategies_used_to_spell_out():
    from gradsync.comm import CodecSpec

    assert CodecSpec.having("momentum_correctable") == ("sign", "topk", "sparseloco")
    assert CodecSpec.having("masks_sent") == ("topk", "sparseloco")
    assert CodecSpec.having("biased") == ("sign", "topk", "powersgd", "sparseloco")
    assert CodecSpec.having("all_gathered") == ("sparseloco",)
    assert [n for n in ("identity", "int8", "sign", "powersgd", "sparseloco")
            if not CodecSpec.parse(n, {}, None).traits.survives_membership_change] == ["sign", "powersgd"]
    assert CodecSpec.parse("powersgd", {}, True).keeps_memory()
    assert not CodecSpec.parse("powersgd", {"warm_start": False}, False).keeps_memory()
    assert not CodecSpec.parse("int8", {}, True).keeps_memory()
