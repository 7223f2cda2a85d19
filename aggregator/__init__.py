"""The switch emulator: a sans-I/O slot-table core, its burst data plane, and the control plane."""
