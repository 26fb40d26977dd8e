"""Sizing a scheme: the memory and decode-speed ledger per GPU (`ledger`), and what a scheme does to each layer's weights (`report_quant`)."""
