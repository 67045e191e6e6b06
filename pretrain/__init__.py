"""pretrain"""
