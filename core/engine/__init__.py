"""core/engine"""
