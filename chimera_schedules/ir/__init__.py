"""The schedule IR, the bottom layer: actions, schedules, the dataflow rule, channel names, costs, the
request spec and the errors. It imports nothing from the layers above it."""
