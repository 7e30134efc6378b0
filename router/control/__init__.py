"""The control plane: discovery of groups of ranks, the group-epoch ready gate, drain.

Only endpoints of a group whose *current* epoch passed the gate are candidates for a pick; a new
epoch revokes the old one in the same loop turn. ``docs/architecture.md`` has the state machine.
"""
