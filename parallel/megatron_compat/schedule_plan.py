"""megatron-core's schedule plans (the EP all-to-all overlap) for this model: the plan's nodes run
under their micro-batch, and the one shared MTP layer is planned once per depth.

With ``overlap_moe_expert_parallel_comm`` megatron-core 0.19.2's combined 1F1B schedule does not
call the model's forward: the forward step returns ``GPTModel.build_schedule_plan(...)``, a
``TransformerModelChunkSchedulePlan`` whose nodes (pre-process, per layer pre-dispatch
computation (attention and router) / dispatch / experts / combine / MTP post-process,
post-process) the schedule runs later, one micro-batch's
forward nodes between another's backward nodes. Two things the model's forward does are then
missing:

- the micro-batch context (``micro_batch.py``: document ids on the host, MTP shifts inside
  documents, the MLA -> DSA hand-over) is active only inside ``GLM5Model.forward``:
  :func:`adapt` makes every node's forward and backward run under the micro-batch the plan was
  built for (recomputation inside a node re-enters it, as in the forward path);
- megatron plans one node set per layer of ``model.mtp.layers``; GLM-5 has one layer applied at
  ``depths`` depths: :func:`adapt` plans it ``depths`` times (the first plan splits off the
  decoder's hidden states, the last concatenates every depth's, as megatron's first and last MTP
  layer plans do), so the post-process node receives the [1 + depths] chunks the model's loss
  expects (``mtp.config_with_mtp_depths``).
"""

from __future__ import annotations

from parallel.megatron_compat.version import check_megatron_core

#: the node attributes of megatron's ``TransformerLayerSchedulePlan``
LAYER_NODES = ("pre_dispatch_computation", "moe_dispatch", "mlp", "moe_combine", "mtp_post_process")


def adapt(plan, micro_batch, mtp_depths: int):
    """``plan`` (``GPTModel.build_schedule_plan``'s) with the shared MTP layer planned at each of
    ``mtp_depths`` depths and every node bound to ``micro_batch``; returns it."""
    from megatron.core.models.common.model_chunk_schedule_plan import TransformerLayerSchedulePlan
    from megatron.core.pipeline_parallel.utils import get_comm_stream, get_comp_stream
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

    check_megatron_core(__file__)
    layers = [plan.get_layer(i) for i in range(plan.num_layers())]
    mtp = [p for p in layers if isinstance(p.layer, MultiTokenPredictionLayer)]
    if mtp and mtp_depths > 1:
        if len(mtp) != 1 or layers[-1] is not mtp[0]:
            raise RuntimeError(f"expected the one shared MTP layer last in the chunk's plan, got "
                               f"{len(mtp)} MTP layer plans of {len(layers)}")
        shared = plan.pop_layer().layer
        for depth in range(mtp_depths):
            layer_plan = TransformerLayerSchedulePlan(
                shared, plan.event, plan.state, get_comp_stream, get_comm_stream,
                {"is_first_layer": depth == 0, "is_last_layer": depth == mtp_depths - 1})
            if depth:
                _collect_the_depth_input_as_this_nodes_leaf(layer_plan.pre_dispatch_computation)
            plan._transformer_layers.append(layer_plan)
    for node in _nodes(plan):
        node.forward = micro_batch.bind(node.forward)
        node.backward = micro_batch.bind(node.backward)
    return plan


def _collect_the_depth_input_as_this_nodes_leaf(attn_node) -> None:
    """Each MTP post-process node appends its depth's hidden states to the chunk's list, which
    the last one concatenates for the loss. A node's backward runs the autograd graph from its
    detached inputs to its outputs once; megatron plans one MTP layer, whose list holds only the
    first attention node's detached input, so the concatenation's backward stays in graphs
    nothing else traverses. With more depths the list would hold depth d's output itself, inside
    depth d's post-process graph, which the last node's backward would then free before depth
    d's own backward runs ("backward through the graph a second time"). Depth d + 1's attention
    node takes that output as its input: the list keeps the node's detached copy instead (the
    same storage), whose gradient the node hands back with its own."""
    forward = attn_node.forward

    def forward_collecting_leaf(*args, **kwargs):
        out = forward(*args, **kwargs)
        attn_node.chunk_state.mtp_hidden_states[-1] = attn_node.inputs[0]
        return out

    attn_node.forward = forward_collecting_leaf


def _nodes(plan) -> list:
    """Every node of the plan that runs the model's modules (the no-op ones excluded)."""
    from megatron.core.pipeline_parallel.utils import NoopScheduleNode

    nodes = [plan.pre_process, plan.post_process]
    for i in range(plan.num_layers()):
        nodes += [getattr(plan.get_layer(i), name) for name in LAYER_NODES]
    return [n for n in nodes if n is not None and not isinstance(n, NoopScheduleNode)]
