"""Huawei MindIE's native inference API."""
