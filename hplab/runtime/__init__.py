"""The runtime: what happens around the strategies, attached from outside. Joining the process
group and layering the collectives (`group`), starting and watching processes and restarts
(`launch`), faults injected on purpose (`faults`), the emulated wire (`link`) and a real
machine's balance on it (`balance`), a failed collective said in one line (`errors`), and clocks
that time the device's work (`clock`)."""
