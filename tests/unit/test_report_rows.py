"""The text summary's rows, from summaries written by hand."""

from gradsync.platform.report import summary_rows


def rows(**summary):
    return dict(summary_rows({"comm": {}, **summary}))


def test_processes_x_nodes_multiplies_to_the_world_size():
    assert rows(world_size=2, num_nodes=2, backend="gloo", accelerator="cpu")["processes x nodes"].startswith("1 x 2")
    assert rows(world_size=8, num_nodes=2, backend="nccl", accelerator="gpu")["processes x nodes"].startswith("4 x 2")


def test_scope_rows_show_the_inter_node_ratio_only_where_sync_bytes_were_booked():
    comm = {"by_scope": {"intra_node": {"wire_bytes": 4000, "logical_bytes": 0, "collectives": 3},
                         "inter_node": {"wire_bytes": 100, "logical_bytes": 4000, "compression_ratio": 40.0,
                                        "collectives": 1}}}
    table = dict(summary_rows({"comm": comm, "world_size": 4, "num_nodes": 2}))
    assert "ratio" not in table["intra-node bytes"] and "ratio 40" in table["inter-node bytes"]
