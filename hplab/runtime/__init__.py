"""The runtime: what happens around the strategies, attached from outside. Joining the process
group (`group`), starting and watching processes and restarts (`launch`), faults injected on
purpose (`faults`), the emulated wire (`link`), and clocks that time the device's work
(`clock`)."""
