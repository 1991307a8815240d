# State made before the bucket moved into ../modules/weights_bucket: the same objects, new addresses.
moved {
  from = aws_s3_bucket.replica
  to   = module.replica.aws_s3_bucket.this
}
moved {
  from = aws_s3_bucket_public_access_block.replica
  to   = module.replica.aws_s3_bucket_public_access_block.this
}
moved {
  from = aws_s3_bucket_versioning.replica
  to   = module.replica.aws_s3_bucket_versioning.this
}
moved {
  from = aws_s3_bucket_lifecycle_configuration.replica
  to   = module.replica.aws_s3_bucket_lifecycle_configuration.this
}
