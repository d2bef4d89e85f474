"""Megatron-Core's group semantics written out independently (tests only): the oracle that
meshgroups.compat.megatron_layout / meshgroups.compat.parallel_state are checked against."""

from __future__ import annotations

from math import prod

from ..layout.test_layout_order import megatron_groups


def megatron_expected(world, tp=1, pp=1, cp=1, ep=1, etp=None, n_opt=1, order="tp-cp-ep-dp-pp", hcp=None):
    etp = etp or tp
    dp, edp = world // (tp * pp * cp), world // (etp * ep * pp)
    dense = {"tp": tp, "cp": cp, "ep": 1, "dp": dp, "pp": pp}
    expert = {"tp": etp, "cp": 1, "ep": ep, "dp": edp, "pp": pp}
    out = {
        name: megatron_groups(order, sizes, token)
        for name, sizes, token in [
            ("tp", dense, "tp"),
            ("pp", dense, "pp"),
            ("mp", dense, "tp-pp"),
            ("cp", dense, "cp"),
            ("tp_cp", dense, "tp-cp"),
            ("dp", dense, "dp"),
            ("dp_cp", dense, "dp-cp"),
            ("tp_dp", dense, "tp-dp"),
            ("tp_dp_cp", dense, "tp-dp-cp"),
            ("ep", expert, "ep"),
            ("expt_tp", expert, "tp"),
            ("tp_ep", expert, "tp-ep"),
            ("tp_ep_pp", expert, "tp-ep-pp"),
            ("expt_dp", expert, "dp"),
        ]
    }
    out["embd"] = [[r[0], r[-1]] if len(r) > 1 else [r[0]] for r in out["pp"]]
    out["pos_embd"] = [[r[0]] for r in out["pp"]]
    intra = dp * cp // n_opt
    out["intra_dp_cp"] = [row[i * intra : (i + 1) * intra] for row in out["dp_cp"] for i in range(n_opt)]
    e_intra = edp // n_opt
    out["intra_expt_dp"] = [
        row[i * e_intra : (i + 1) * e_intra] for row in out["expt_dp"] for i in range(n_opt)
    ]
    out["inter_dist_opt"] = [row[i::e_intra] for row in out["expt_dp"] for i in range(e_intra)]
    # Megatron: consecutive runs of e_intra tp-ep-pp groups, concatenated (new_group sorts them)
    model_groups = megatron_groups(order, expert, "tp-ep-pp")
    out["intra_dist_opt"] = [
        sorted(r for g in model_groups[i : i + e_intra] for r in g)
        for i in range(0, len(model_groups), e_intra)
    ]
    for level, s in enumerate(hcp or []):
        u, rest = prod(hcp[:level]), prod(hcp[level + 1 :])
        out[f"hcp_{level}"] = [
            [row[li * s * u + si * u + ui] for si in range(s)]
            for row in out["cp"]
            for li in range(rest)
            for ui in range(u)
        ]
    return out


def row_of(rows, rank):
    found = [r for r in rows if rank in r]
    assert len(found) <= 1, found
    return found[0] if found else None


CONFIGS_8 = [
    {"tp": 2, "pp": 2},
    {"tp": 2, "cp": 2, "hcp": [2, 1]},
    {"tp": 2, "ep": 2, "etp": 1},
    {"ep": 2, "pp": 2, "n_opt": 2},
    {"tp": 2, "pp": 2, "order": "tp-cp-ep-pp-dp"},
]
