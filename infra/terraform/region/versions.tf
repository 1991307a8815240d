terraform {
  required_version = ">= 1.6"
  # The aws provider's version range is set in ../modules/weights_bucket, which every root uses.
}

provider "aws" {
  region = var.aws_region
}
